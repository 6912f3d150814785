"""A model with a planted float16 overflow, for `mixprec doctor` tests."""

import torch
from torch import nn


class Amplify(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        big = x * 1e5
        return torch.matmul(big, self.weight) * 1e-5  # PLANTED: 1e5 * x overflows float16 in the matmul


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
        self.decoder = nn.Sequential(Amplify(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


def build():
    torch.manual_seed(0)
    return Net(), (torch.randn(32, 8),), lambda out: out.float().pow(2).mean()


def build_forward_only():
    torch.manual_seed(0)
    return Net(), (torch.randn(32, 8),)


def healthy():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), (torch.randn(32, 8),)


def wrong_shape():
    return nn.Linear(2, 2)


def raises():
    raise FileNotFoundError("weights.pt")


class Quits(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise SystemExit(0)  # (a script's sys.exit reached from the model's forward)


def exits_in_forward():
    return Quits(), (torch.randn(2, 2),)


NOT_CALLABLE = 3

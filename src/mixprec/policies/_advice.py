"""Why an op is banned, and what to use instead: the text a banned op raises."""

ADVICE = {
    "binary_cross_entropy": (
        "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast: "
        "their backward can produce gradients that float16 cannot represent. Many models put a "
        "sigmoid right before binary cross entropy; combine the two with "
        "torch.nn.functional.binary_cross_entropy_with_logits or torch.nn.BCEWithLogitsLoss, "
        "which are safe to autocast."
    ),
}

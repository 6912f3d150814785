"""``python -m mixprec``: the ``mixprec`` command."""

from mixprec.cli import main

if __name__ == "__main__":
    main()

"""`python -m jaxdecode ...`: the `jaxdecode` command (jaxdecode.cli)."""
import sys

from jaxdecode.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""`python -m toolkit` is the `toolkit` command."""
import sys

from toolkit.cli.main import main

sys.exit(main())

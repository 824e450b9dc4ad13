"""Owns: ``python -m prefixkv.cli`` (how tests and ``prefixkv route --launch`` start workers).
Imports: this package's entry point only."""

import sys

from prefixkv.cli import main

sys.exit(main())

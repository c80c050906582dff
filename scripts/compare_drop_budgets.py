"""The failure-policy sweep, kept under its old path: it runs `python -m minirl.experiments.sweep`
(minirl/experiments/) with the same flags, e.g. `python scripts/compare_drop_budgets.py --quick`."""

import sys

from minirl.experiments.sweep import main

if __name__ == "__main__":
    sys.exit(main())

import os
import sys

# `python -m` puts the current directory first on sys.path; a file there named like an installed
# module (torch.py, optuna.py) would replace it. Search it last: the user's own modules named with
# --model still import, real modules win.
_cwd = os.getcwd()
sys.path[:] = [p for p in sys.path if p not in ("", _cwd)] + [_cwd]

from autotune.cli import main  # noqa: E402

sys.exit(main())

"""`python -m trainer ...` (or under torchrun `-m trainer`): see trainer/train.py."""

import sys

from trainer.train import main

sys.exit(main())

import sys

from .instruments.cli import main

sys.exit(main())

from .instruments.cli import entry

entry()

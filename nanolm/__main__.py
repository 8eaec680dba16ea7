from .instruments.cli import entry

if __name__ == "__main__":  # not when a worker process re-imports the parent's main module (spawn)
    entry()

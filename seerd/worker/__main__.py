import sys

from seerd.worker.main import main

if __name__ == "__main__":
    sys.exit(main())

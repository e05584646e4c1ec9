import sys

from minikv.cli import main

sys.exit(main())

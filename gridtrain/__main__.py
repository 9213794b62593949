import sys

from gridtrain.cli import main

sys.exit(main())

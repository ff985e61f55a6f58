import sys

from megatron_hybridep.cli import main

sys.exit(main())

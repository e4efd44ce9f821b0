import sys

from jaxbundle.cli import main

sys.exit(main())

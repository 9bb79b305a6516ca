from tpcheck.cli.app import main
import sys
sys.exit(main())

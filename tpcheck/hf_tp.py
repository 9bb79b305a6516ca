"""``python -m tpcheck.hf_tp`` / ``torchrun -m tpcheck.hf_tp``: Hugging Face TP ranks that dump their points
(the module is ``tpcheck.engines.hf_tp``)."""
import sys

from tpcheck.engines.hf_tp import main

if __name__ == "__main__":
    sys.exit(main())

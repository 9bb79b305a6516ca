"""References: Hugging Face's model with capture hooks (``hf``: the float64 golden and the noise floor's model at
the test dtype), the TP-rounding reference (``reductions``), the golden streamed from the checkpoint
(``streamed``) and goldens saved and replayed (``saved``)."""

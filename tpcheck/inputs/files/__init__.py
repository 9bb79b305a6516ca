"""What tpcheck keeps on disk and reads back, each file untrusted: the per-step tensor store of dumps and saved
goldens (``step_store``), a checkpoint's fingerprint (``fingerprint``), the checks of JSON fields (``validate``) and of a
quantized checkpoint's tensors (``quant_check``)."""

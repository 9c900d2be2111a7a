"""kiln: a compiler-based optimizing runtime for LLM inference."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RuntimeConfig", "SchedulerConfig"]


def __getattr__(name):
    # Lazy, so `import kiln` (and the build path) does not load onnxruntime sessions or numpy code.
    if name == "LLM":
        from kiln.runtime.llm import LLM
        return LLM
    if name == "SamplingParams":
        from kiln.runtime.sampling_params import SamplingParams
        return SamplingParams
    if name == "RuntimeConfig":
        from kiln.config import RuntimeConfig
        return RuntimeConfig
    if name == "SchedulerConfig":
        from kiln.config import SchedulerConfig
        return SchedulerConfig
    raise AttributeError(name)

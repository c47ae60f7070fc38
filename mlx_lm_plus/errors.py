"""What a request's client is told when planning or generating fails, and
how any exception raised there becomes one of these (`request_error`). The
HTTP side maps each to its status (errors are answered, never left
hanging)."""


class RequestError(ValueError):
    """A bad request: answered with `{"error": message}` and `status`."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class Cancelled(Exception):
    """The client of the request being prefilled went away."""


class EngineUnavailable(RuntimeError):
    """The generation thread is not running."""


class PromptError(ValueError):
    """The request could not be turned into a prompt (bad content, template)."""


class ModelLoadError(RuntimeError):
    """The requested model, adapter or draft model could not be loaded."""


class OutOfMemory(EngineUnavailable):
    """MLX could not allocate memory for this request (503, try again later)."""


class InternalError(RuntimeError):
    """Something failed that is not the client's fault (500)."""


def is_out_of_memory(error: BaseException) -> bool:
    """An MLX allocation failure ("[metal::malloc] Unable to allocate ...",
    "[malloc] ...", "[cuda::malloc] ...")."""
    if isinstance(error, MemoryError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and ("malloc]" in text or "Unable to allocate" in text)


def request_error(error: Exception, what: str) -> Exception:
    """The error a request's client gets for `error`, raised while doing `what`:
    errors of ours as they are, an allocation failure as OutOfMemory, anything
    else as an InternalError (a 500, never a hang)."""
    if isinstance(error, (PromptError, ModelLoadError, EngineUnavailable, InternalError)):
        return error
    if "maximum allowed buffer size" in str(error):
        # Metal's limit on one buffer: this request can never fit, retrying
        # won't help (400, and no reason to give up the prompt cache).
        return PromptError(f"The request needs a larger buffer than this machine "
                           f"allows while {what}: {error}")
    if is_out_of_memory(error):
        return OutOfMemory(f"Out of memory while {what}: {error}")
    return InternalError(f"Internal error while {what}: {error!r}")

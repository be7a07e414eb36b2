"""Turning a user's backend choice ("auto", "cpu", "cuda", "cuda:N", "mps") into a ready backend."""

from __future__ import annotations

from dataclasses import fields

from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendRequirements, dtype_names, parse_device
from ferrum.backends.registry import BackendRegistry, preference_key

VALID_BACKEND_SPECS = "auto, cpu, cuda, cuda:N (N = 0, 1, ...), mps"


class BackendSelectionError(RuntimeError):
    """No backend can serve the request; the message says what exists and why each one fails."""


def parse_backend_spec(spec: str) -> str | None:
    """None for "auto", else the requested device string; BackendSelectionError if malformed."""
    if spec == "auto":
        return None
    try:
        parse_device(spec)
    except ValueError:
        raise BackendSelectionError(
            f"invalid backend {spec!r}; valid forms: {VALID_BACKEND_SPECS}"
        ) from None
    return spec


async def select_backend(
    registry: BackendRegistry,
    spec: str,
    requirements: BackendRequirements | None = None,
    quantization: str | None = None,
) -> tuple[ComputeBackend, str]:
    """Pick a backend and device for `spec`, initialize it on that device, and return both.

    "auto" takes `registry.find_best(requirements)`. "cpu", "mps", "cuda" and "cuda:N" take the
    registered backends of that kind which serve the device and meet the requirements, preferring
    as `find_best` does. Failing that, BackendSelectionError lists every registered backend with
    its devices, dtypes and unmet requirements.

    `quantization`: the served model's weight quantization method ("int4", ...). The backend picked
    must run it, else BackendSelectionError naming the method and the device. Unlike a method in
    `requirements.quantization`, it does not steer "auto" to another kind (weights quantized for a GPU
    are never served on the CPU unasked).
    """
    wanted = requirements or BackendRequirements()
    requested_device = parse_backend_spec(spec)
    if requested_device is None:
        backend = await registry.find_best(wanted)
        if backend is None:
            headline = f"no registered backend meets the requirements ({_summary(wanted)})"
            raise _selection_error(registry, wanted, headline)
        device = _device_for_requirements(backend, wanted)
    else:
        backend = _pick_for_device(registry, requested_device, wanted)
        device = backend.resolve_device(requested_device)
    if quantization is not None and quantization != "auto":  # auto: the engine picks what the device runs
        _check_quantization(backend, device, quantization)
    try:
        await backend.initialize(device)
    except Exception as error:
        message = f"backend {backend.name} failed to initialize {device}: {error}"
        raise BackendSelectionError(message) from error
    return backend, device


def _pick_for_device(registry: BackendRegistry, device: str, wanted: BackendRequirements) -> ComputeBackend:
    kind, _ = parse_device(device)
    requested = f"backend {device!r} was requested, but"
    of_kind = [backend for backend in registry.list() if backend.kind == kind]
    if not of_kind:
        raise _selection_error(registry, wanted, f"{requested} no {kind} backend is registered")
    serving = [backend for backend in of_kind if backend.supports_device(device)]
    if not serving:
        raise _selection_error(registry, wanted, f"{requested} no {kind} backend serves it")
    meeting = [backend for backend in serving if backend.capabilities().meets_requirements(wanted)]
    if not meeting:
        headline = f"{requested} it does not meet the requirements ({_summary(wanted)})"
        raise _selection_error(registry, wanted, headline)
    return min(meeting, key=preference_key)


def _check_quantization(backend: ComputeBackend, device: str, method: str) -> None:
    capabilities = backend.capabilities()
    if method in capabilities.quantization:
        return
    runs = ", ".join(sorted(capabilities.quantization)) or "none"
    why = capabilities.quantization_needs.get(method, f"backend {backend.name} runs {runs}")
    raise BackendSelectionError(
        f"quantization {method} cannot run on {device}: {why}. Quantization methods {device} runs: {runs}; "
        f"choose one of them, no quantization, or another backend (--backend)."
    )


def _device_for_requirements(backend: ComputeBackend, wanted: BackendRequirements) -> str:
    """The first required device this backend serves, made concrete; else its default device."""
    for device in wanted.devices:
        if backend.supports_device(device):
            return backend.resolve_device(device)
    return backend.default_device()


def _selection_error(
    registry: BackendRegistry, wanted: BackendRequirements, headline: str
) -> BackendSelectionError:
    """One multi-line message: what went wrong, every backend with its unmet requirements, valid choices."""
    return BackendSelectionError(
        f"{headline}.\n"
        f"Available backends:\n{registry.explain(wanted)}\n"
        f"Valid backend choices: {VALID_BACKEND_SPECS}."
    )


def _summary(wanted: BackendRequirements) -> str:
    """The requirements that differ from the defaults, e.g. "dtypes bfloat16; flash attention"."""
    defaults = BackendRequirements()
    parts: list[str] = []
    for requirement_field in fields(wanted):
        value = getattr(wanted, requirement_field.name)
        if value == getattr(defaults, requirement_field.name):
            continue
        if requirement_field.name == "dtypes":
            parts.append(f"dtypes {dtype_names(value)}")
        elif requirement_field.name in ("devices", "quantization"):
            parts.append(f"{requirement_field.name} {', '.join(value)}")
        elif isinstance(value, bool):
            parts.append(requirement_field.name.removeprefix("requires_").replace("_", " "))
        else:
            parts.append(f"{requirement_field.name.replace('_', ' ')} {value}")
    return "; ".join(parts) or "none"

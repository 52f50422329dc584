"""What a profile asks for (`start_profile`): every actor records its steps into its own
Chrome trace file (runtime/tracing.py), the worker with `torch.profiler`."""

from __future__ import annotations

from collections.abc import Sequence

from runtime.tracing import ProfileRequest

ACTIVITIES = ("CPU", "GPU")


def profile_request(
    output_dir: str,
    num_steps: int | None,
    activities: Sequence[str],
    record_shapes: bool,
    with_stack: bool,
) -> ProfileRequest:
    """The profile to run; ValueError naming what is wrong with the request."""
    unknown = sorted(set(activities) - set(ACTIVITIES))
    if unknown or not activities:
        raise ValueError(f"activities must be among {', '.join(ACTIVITIES)}, got {unknown}")
    if num_steps is not None and num_steps < 1:
        raise ValueError(f"num_steps must be at least 1, not {num_steps}")
    return ProfileRequest(output_dir, num_steps or 0, tuple(activities), record_shapes, with_stack)

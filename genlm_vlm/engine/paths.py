"""Which engine path a controller run takes: ``lm.smc(..., engine_path=...)`` on the engine
thread.

* ``"bursts"``: a burst (:mod:`.bursts`): every live particle resumed as a streaming-input
  session each step.
* ``"requests"``: particles as running requests (:mod:`.particles`) wherever this engine and run
  allow it (:meth:`~.forcing.ParticleHost.refusal`); else a burst, with the reason.
* ``"auto"`` (the default): the requests path where it is covered and was measured no slower than
  bursts, bursts elsewhere, with the reason (:func:`auto_refusal`). The rule: a path never run
  on a kind of device is never the silent default there, so on anything but vLLM's CPU build
  ``"auto"`` takes bursts until the requests path has been run and measured on that device.

Which path ran is ``stats["engine_path"]``; why a run that asked for (or was given by
``"auto"``) the requests path ran as a burst is ``stats["engine_path_fallback"]``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .build import is_cpu_platform

if TYPE_CHECKING:
    from .jobs import Job

#: ``stats["engine_path_fallback"]`` of an ``engine_path="auto"`` run on a GPU (or any device
#: but the CPU build): the requests path has not been measured there.
GPU_UNMEASURED = "requests path not yet measured on a GPU: pass engine_path='requests' to use it"


def asked(job: Job) -> str:
    """The path ``job`` (a controller run) asked for: ``"auto"``, ``"bursts"`` or ``"requests"``."""
    return getattr(job.spec, "path", "bursts")


def on_measured_device(host: Any) -> bool:
    """Whether this engine runs where the requests path was measured (vLLM's CPU build);
    decided once per ``host`` (a :class:`~.forcing.ParticleHost`)."""
    known = getattr(host, "_measured_device", None)
    if known is None:
        known = host._measured_device = bool(is_cpu_platform())
    return known


def auto_refusal(host: Any, job: Job) -> str | None:
    """Why an ``engine_path="auto"`` run goes to bursts (None: it takes the requests path):
    :data:`GPU_UNMEASURED` off the CPU build, else whatever keeps the requests path from this
    engine or run (:meth:`~.forcing.ParticleHost.refusal`). Every case the requests path covers
    on the CPU build was measured no slower there (docs/BENCHMARKS.md, ninth session), products
    of prompts and lockstep at N > ``max_num_seqs`` included; a case measured slower would get
    its rule and reason here."""
    if not on_measured_device(host):
        return GPU_UNMEASURED
    return host.refusal(job)

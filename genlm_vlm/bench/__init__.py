"""``python -m genlm_vlm bench``: genlm_vlm against vLLM on your own model and machine.

* :mod:`~genlm_vlm.bench.cli`: the command's options and checks.
* :mod:`~genlm_vlm.bench.workloads`: the named workloads (rows, smc, scoring, lm-eval, control),
  their systems and inputs.
* :mod:`~genlm_vlm.bench.systems`: the systems, each built in a process of its own.
* :mod:`~genlm_vlm.bench.harness`: processes, alternating repetitions, medians.
* :mod:`~genlm_vlm.bench.runner`: cells, checks of the work done, ratios.
* :mod:`~genlm_vlm.bench.report`: versions, the ratio table, JSON and the plot.

Importing this package imports neither torch nor vLLM.
"""

from __future__ import annotations

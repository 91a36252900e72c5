"""Studies of mgnn itself, behind ``python -m mgnn bench ...``: benchmarks against baselines and
cost models, scaling runs, predictions on virtual ranks. The core (``mgnn.network``,
``mgnn.mgrit``, ``mgnn.backend``, ``mgnn.comm``) never imports from here.

- :mod:`.bench` -- kernel and MGRIT benchmarks (``bench kernels``, ``mgrit``, ``gpu-launches``,
  ``recurrent``), timing helpers
- :mod:`.bench_spatial` -- spatial coarsening: residuals, work and step time (``bench spatial``,
  ``spatial-step``)
- :mod:`.scaling` -- strong/weak scaling under ``mpiexec`` against serial, layer-wise and
  pipeline training (``bench scaling``)
- :mod:`.pipeline` -- the GPipe-style pipeline baseline (``PipelineParallel``, exact gradients)
- :mod:`.costs` -- calibrated kernel and message costs (``bench calibrate``)
- :mod:`.predict` -- time per step on virtual ranks (``bench predict``)

Their old paths (``mgnn.bench``, ``mgnn.scaling``, ...) still import: :mod:`mgnn._moved`.
"""

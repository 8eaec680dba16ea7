"""The instruments around the course's concepts: what a practitioner runs about a run.

``nanolm/`` holds the concepts a student reads to learn training (the loop, the step, the
model with its loss, batches, optimizers, number formats, evaluation, sampling, tokenizers,
checkpoints, data parallelism) and, in its subpackages, what the loop relies on (``data/``,
``run/``, ``machine/``, ``watch/``). This package holds what is run *around* training; a
plain ``nanolm train`` imports none of it but the command itself (``cli``), its process
settings (``process``) and the lab's list of variants, for ``--help``:

* ``cli``: the ``nanolm`` command; ``process``: what it does to its own process;
* ``doctor``: health checks before a run;
* ``diagnose``: what went wrong, read from a run's metrics and events;
* ``compare``: whether two runs trained the same thing;
* ``lab`` and ``faults``: runs broken on purpose (by swapping components), each diagnosed;
* ``replay``: one logged step again, fully instrumented;
* ``sweep``: short runs at several learning rates;
* ``report``: plots and a self-contained HTML page;
* ``export``: a run as a Hugging Face ``transformers`` model;
* ``trained``: a trained run put to use: ``nanolm sample`` and ``nanolm eval``.
"""

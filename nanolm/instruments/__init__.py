"""The instruments around the course's concepts: what a practitioner runs about a run.

``nanolm/`` itself holds the concepts a student reads to learn training (tokenizer, data,
model, loss, optim, precision, step, train, evaluate, checkpoint, distributed) and the parts
the training loop relies on (the run directory, the observer and its statistics, the guard,
the configuration). This package holds what is run *around* training, none of which the
training path imports:

* ``cli``: the ``nanolm`` command;
* ``doctor``: health checks before a run;
* ``diagnose``: what went wrong, read from a run's metrics and events;
* ``lab`` and ``faults``: runs broken on purpose (by swapping components), each diagnosed;
* ``sweep``: short runs at several learning rates;
* ``report``: plots and a self-contained HTML page;
* ``export``: a run as a Hugging Face ``transformers`` model.
"""

"""A run: where it lives and what running the same command again does there, its configuration,
its final weights, what may change when it is continued, and what it will cost before it starts
(``nanolm plan`` and the memory check). Writing its files whole and its one writer stand on the
ground floor, ``nanolm/base/``; the checkpoint format itself is a concept of the course,
``nanolm/checkpoint.py``."""

"""The machine a run trains on: which device and what it can do, the hardware's peak FLOP/s,
CPU threads, the process settings a run changes and puts back (seeds, determinism, TF32,
signals), and --threads auto's tuner. (The plan of memory and time before a run is
``nanolm/run/plan.py``: it counts the model's own shapes.)"""

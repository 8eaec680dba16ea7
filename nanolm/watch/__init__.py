"""Watching a run: the observer (what to log, and when), the validator (when to evaluate), the step meter, per-layer
statistics, the sinks the numbers go to (metrics.jsonl, TensorBoard, wandb, the terminal), the
guard that acts on NaNs and spikes, and the reference bands a recognised run is judged by."""

"""The ground floor: what every room stands on. Writing a file whole (or not at all), reading
JSON and TOML under guard, one writer per directory, tensors stored as safetensors shards.
These modules import nothing of nanolm but its one exception, ``nanolm.errors``, so that the
tokenizer, the checkpoint, the data and the watchers can all write through them."""

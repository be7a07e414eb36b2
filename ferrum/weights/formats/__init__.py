"""Weight files read as tensors: the SafeTensors header (untrusted input) and the readers of each format."""

"""What the WeightLoader is asked for and how it works: weight sources and formats, tensor specs and their
transformations, dtype and shape values, and the loader's configuration."""

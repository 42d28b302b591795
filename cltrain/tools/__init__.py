"""Console scripts that sit on top of the library, the data path and the app."""

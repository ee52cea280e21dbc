"""Independent references the Python tests compare gradkit with."""

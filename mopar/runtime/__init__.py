"""What runs inside a function, and the local runner. Never imports torch or the compiler phases."""

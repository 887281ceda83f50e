"""What runs inside a deployed function. Never imports torch, the compiler phases or `mopar.runner`."""

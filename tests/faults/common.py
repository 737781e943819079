"""Shared flags of the fault tests: a tiny GPT on mock data, gloo, fast logs."""

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--distributed-backend", "gloo",
        "--seed", "7"]
MOCK = ["--mock-data", "--vocab-size", "100"]

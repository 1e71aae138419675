"""The dispatcher: a pure scheduling policy, and the loop that feeds it from Redis."""

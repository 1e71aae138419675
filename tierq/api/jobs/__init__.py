"""The native job API: submit, poll, list, cancel, follow over SSE."""

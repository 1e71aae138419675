"""`tierq worker`'s exit statuses, which its supervisors act on."""

EXIT_REFUSED = 2  # its configuration cannot work: starting it again will not help
EXIT_ENGINE_DEAD = 3  # its engine died; its jobs went back to their tiers
EXIT_WORKER_ID_TAKEN = 4  # another live worker holds its WORKER_ID

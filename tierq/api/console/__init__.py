"""The operator console (`/console`): a page and its two static files, no data of its own."""

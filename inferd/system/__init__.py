"""inferd's processes on their machine: what every child does first (child), logging (logs), systemd's
notifications (systemd), memory handed back (heap), the runtime and state folders (paths), and the names of
files in /dev/shm (shm_names)."""

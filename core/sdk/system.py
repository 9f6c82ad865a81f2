"""What plugins size their memory by: how much of the machine's RAM is available."""

from __future__ import annotations

import os


def available_memory_bytes() -> int:
    """The kernel's estimate of memory available without swapping (MemAvailable: free pages plus
    the page cache and other memory it can reclaim). Free pages alone shrink with every file read,
    so a machine that had just read gigabytes would size a much smaller cache."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")

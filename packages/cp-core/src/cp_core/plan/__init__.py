"""Host-only attention planning over ranges: kinds, band rectangles, pieces, crop, schedules."""

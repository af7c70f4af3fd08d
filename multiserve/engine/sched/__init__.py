"""What the next step computes, with no jax (checked by tests/engine/test_no_jax_scheduling.py):
requests (`request`), admission bounds (`admission`), the page allocator
(`page_allocator`), the prefix cache (`prefix_cache`) and the scheduler (`scheduler`)."""

"""The training side: what runs inside ``optimizer.step()`` and the loop's own calls. It never blocks, allocates or synchronizes the host with the device in a hook."""

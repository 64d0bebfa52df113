"""The torch side: ``load_state_dict`` and ``load_into`` on our own reader, devices and
``map_location``.
"""

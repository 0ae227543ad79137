"""This machine and the bundle that runs on it: the CPU (:mod:`.cpu`), what the machine
offers and which bundles are visible (:mod:`.inventory`), the data both speak in
(:mod:`.facts`), the choice among bundles (:mod:`.choice`), and memory pages given back to the
OS (:mod:`.mapped_pages`).  Imports no backend at module level.
"""

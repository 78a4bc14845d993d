"""What every part of tmcore consults at run time: the options (:mod:`.options`, the one
home of every switch and environment variable), the dispatch of primitives to a
namespace's fast paths (:mod:`.dispatch`), argument validation (:mod:`.validate`) and
size bounds checked before allocating (:mod:`.sizes`)."""

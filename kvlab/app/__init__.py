"""kvlab's programs: ``cli`` (the ``kvlab`` command), ``bench`` (every benchmark in one table), ``lab``
(JupyterLab on the course), ``render`` (the chapters as a static site) and ``resources`` (finding the course files
kvlab ships).
"""

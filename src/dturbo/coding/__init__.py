"""The codec's parts (:mod:`dturbo.codec` frames and reads them all): byte and bit primitives (``bits``), positions
(``positions``), the rectangle search of cluster coding (``rectangles``), cluster-coded grids and supports
(``grid``), FedPM's masks under the receiver's probabilities (``masks``), and quantised values under a fitted
discretised Gaussian or Laplace (``values``, ``[dturbo.transmission] values_code = "range"``)."""

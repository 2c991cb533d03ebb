"""Ranks: starting them (launch), keeping them alive between cells (live), the notebook magic
(magic). Above comm (a launch may emulate a network with comm's topology); below everything that
trains: models and strategies never start ranks."""
